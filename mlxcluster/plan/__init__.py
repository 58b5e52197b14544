"""Planning a run before it starts: the model as its files describe it, what each rank's memory
holds at its peak, term by term, and the layouts a cluster allows for it (`invoke plan`).
"""
