"""flexmesh.sim"""
