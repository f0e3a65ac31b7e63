"""Llama-family model, loaders (GGUF / Hugging Face / random shapes), tokenizer and chat template."""
