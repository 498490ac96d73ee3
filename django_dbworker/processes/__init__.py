"""The pool of child processes, what a child does with the rows it is sent, and what they say to each other."""
