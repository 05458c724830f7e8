"""Training recipe of the bundled default model (see train_default_model.py)."""
