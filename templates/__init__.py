"""mlxchat's data, shipped inside the package and read with ``importlib.resources``: sampling presets (``presets/``)."""
