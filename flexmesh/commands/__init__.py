"""Sub-commands of the ``flexmesh`` CLI (see flexmesh.cli)."""
