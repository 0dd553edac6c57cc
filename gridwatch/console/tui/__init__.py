"""The Textual console: the app, its views and widgets; the only part of console/ that imports textual."""
