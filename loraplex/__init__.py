"""loraplex: serve many LoRA adapters on one shared base model."""
