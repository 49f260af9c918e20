from streamquake.cli import main

main()
