"""The Gradio web demo: `build_demo(ChatClient(url))` (`vlmrun.web.app`), run by `vlmrun web` (`vlmrun.web.cli`).

`vlmrun.web.client` streams answers from any OpenAI-compatible server; `vlmrun.web.conversation` keeps the
turns and renders them for the Chatbot and for the server.
"""
