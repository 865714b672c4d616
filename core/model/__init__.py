"""The model, the pipeline's first stage: a GGUF file, an MLX folder or a Hugging Face repo id made into an mlx-lm
model and its tokenizer (`loader.load` -> `LoadedModel`).

`gguf` reads the file, `gguf_archs` maps each architecture onto mlx-lm's classes, `gguf_tensors` converts every
ggml type to MLX's affine form (`heap` hands the C heap's free pages back meanwhile); `native_linear`,
`native_blocks` and `native_decoder` run the layers on the native kernel (core/native); `split` is a split model's
slice of the layers (core/distributed); `tokenizer` the tokens and the chat template. Around them: `backend` (the
device MLX runs on), `blas` (the optimized BLAS, loaded before MLX), `hub` (models by name in the Hugging Face
cache), `gguf_writer` (GGUF files written, for tests and the bench).

Core's lowest stage: it imports no other (docs/architecture.md §1).
"""
