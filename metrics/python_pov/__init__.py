"""Local evaluate metric module; see the sibling .py file."""
