"""omni-compile."""
