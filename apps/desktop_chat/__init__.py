"""A small Tk window that chats with the engine (`python -m apps.desktop_chat`)."""
