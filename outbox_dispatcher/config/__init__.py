"""Configuration: the settings model, where its values come from, and the names built from it."""
