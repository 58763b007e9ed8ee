"""flexmesh.runtime"""
