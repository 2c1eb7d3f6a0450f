"""Small models the repository can build itself (no downloads): a character tokenizer and a tiny
random Llama for smoke runs of the CLI."""
