"""The app's screens: loading, the chat, and the modal ones on top of it."""
