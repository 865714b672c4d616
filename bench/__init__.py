"""`mlxchat bench`: this engine side by side with mlx-lm (and llama.cpp when installed), on the same model and prompts.

Modules:

* ``stats``   - pure functions: medians, summaries, ratios, target evaluation, the stdout table (tested without MLX)
* ``prompts`` - prompts of an exact token count, cut from real text (CPython's bundled language reference)
* ``systems`` - one runner per system: mlxchat's Engine, mlx-lm's ``stream_generate`` on the very same loaded
  weights, and llama.cpp through ``llama-cpp-python`` on the same GGUF (only when that package is importable)
* ``cases``   - the multi-turn chat, the rotating-cache run, the TUI path, the roofline and the weight formats
* ``report``  - the JSON file (``schema_version``), its validation, and the PNG plot
* ``run``     - the orchestration and ``run_from_cli`` (``mlxchat bench``); ``python -m bench.run`` works too

Nothing here is imported by the app: matplotlib and llama-cpp-python stay optional.
"""
