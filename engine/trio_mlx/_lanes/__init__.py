"""The lanes that run rows on the model: the continuous batch, the serial lane, the prompt cache."""
