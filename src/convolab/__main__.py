from convolab.cli import main

main()
