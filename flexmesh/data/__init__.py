"""flexmesh.data"""
