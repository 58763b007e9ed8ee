"""flexmesh.profile"""
