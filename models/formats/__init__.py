"""Files to arrays and back: safetensors, config.json, GGUF and tokenizer.json."""
