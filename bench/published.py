"""Predicted vs published per-GPU throughput of well-known training runs, with the preset efficiencies.

Prints the table (and the fits that produce the presets) and records it in bench/RESULTS.md.
Run: python -m bench.published
"""

from __future__ import annotations

from bench._results import record
from flexmesh.cost import calibrate


def main() -> None:
    calibrate.main()
    rows = calibrate.calibration_table()
    lines = ["| run | device | layout | published tokens/s/GPU | predicted | ratio | within 15% |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = "yes" if 0.85 <= r["ratio"] <= 1.15 else "NO"
        lines.append(f"| {r['run']} | {r['device']} | {r['layout']} | {r['published_tokens_per_gpu']:.0f} | "
                     f"{r['predicted_tokens_per_gpu']:.0f} | {r['ratio']:.3f} | {ok} |")
    fa, fh = calibrate.fit_efficiencies("A100"), calibrate.fit_efficiencies("H100")
    intra, inter = calibrate.fit_a2a_efficiency()
    notes = (f"\nFits redone by this run: A100 mm_efficiency {fa['mm_efficiency']:.3f} (unfused attention of the "
             f"2021 runs {fa['unfused_attn_efficiency']:.3f}), H100 mm_efficiency {fh['mm_efficiency']:.3f}, "
             f"attn_efficiency {calibrate.fit_attn_efficiency():.3f}, all-to-all {intra:.3f} / {inter:.3f}. "
             "Sources: Megatron-LM 2104.04473 Table 1 (A100), Llama 3 2407.21783 Table 4 (H100; 4 interleaved "
             "chunks assumed), FlexSP 2412.01523 (attention, all-to-all). See docs/cost-model.md.")
    record("published", "\n".join(lines) + "\n" + notes)


if __name__ == "__main__":
    main()
