"""Finding and reading model checkpoints: Hugging Face folders and GGUF files."""
