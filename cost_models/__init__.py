"""Hardware and interconnect descriptions (data, not code). Found via importlib.resources."""
