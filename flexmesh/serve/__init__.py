"""flexmesh.serve: serving on uneven hardware (torch-free core: metrics, the request simulator, routers and
queue policies; real engines in flexmesh.serve.engine)."""
