"""Weight loaders: turn files on disk (GGUF, safetensors) into tensors, configs and tokenizers."""
