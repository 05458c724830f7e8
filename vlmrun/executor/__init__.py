"""Model runner: builds the ForwardBatch, runs the model, samples."""
