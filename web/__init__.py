"""The Gradio web demo (arrives with the server work; see the issues)."""
