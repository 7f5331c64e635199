"""The interactive chat (Textual). Textual is imported only inside this package."""
