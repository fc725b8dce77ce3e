"""`python -m minillm`: the console script."""
from minillm.entry import main

main()
