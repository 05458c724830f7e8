"""Building blocks shared by the models: norms, activations, rotary embeddings, attention, sampler."""
