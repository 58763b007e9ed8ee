"""Real serving engines on this machine (torch and transformers may be imported here, nowhere else in
:mod:`flexmesh.serve`): docs/serving-engines.md.

- :mod:`.model`: a model built from a spec with seeded random weights (nothing downloads);
- :mod:`.engine`: one engine, transformers' continuous batching with explicit KV blocks, its per-token
  timestamps and a log of its iterations;
- :mod:`.http`: the completion request the engines and the router accept, and how they listen and stop;
- :mod:`.server`: one engine process with an OpenAI-compatible HTTP endpoint on 127.0.0.1;
- :mod:`.router`: flexmesh's router in front of N engine processes, writing ``requests.jsonl``;
- :mod:`.fleet`: starting and stopping engine processes and the router, bounded in time;
- :mod:`.replay`: an open-loop client replaying a trace against the router;
- :mod:`.twin`: the request simulator's fleet of such engines, priced by an engine profile.

The HTTP parts need the ``serve`` extra (``pip install -e .[serve]``: aiohttp).
"""
