"""The controller: everything `invoke` does on the machine the user types at, a room per stage of a
run's way (describe, provision, launch, check, jobs), the lab and the benchmarks beside them, and
the basics every room uses at the top (errors, paths, local commands). The table of rooms in
docs/house.md says what each holds (the README's, in short); tests/unit/test_house.py keeps the rooms
from reaching up."""
