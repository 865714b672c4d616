"""mlxchat's full-screen terminal chat (Textual). It never imports MLX itself: it talks to ``core``."""
