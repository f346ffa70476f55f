import os


def read_config(path):
    """Return the lines of a config file, without comments."""
    with open(path) as f:
        
