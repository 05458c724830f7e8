"""The Gradio web demo: `build_demo(ChatClient(url))` (`web.app`), run by `vlmrun web` (`web.cli`).

`web.client` streams answers from any OpenAI-compatible server; `web.conversation` keeps the
turns and renders them for the Chatbot and for the server.
"""
