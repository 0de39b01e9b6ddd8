"""Plain types shared by every layer; nothing here imports the rest of the project."""
