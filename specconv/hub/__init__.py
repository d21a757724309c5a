"""Publishing specconv outputs on the Hugging Face Hub: plan, naming, model card, split, upload."""
