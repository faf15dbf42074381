"""The apigen subsystem of the application side."""
