"""The HTTP server (`omni-compile serve`): not implemented yet; see the serving issue.

This package exists because the layout fixes it; it holds no code until the server lands.
"""
