from butlers.cli import main

main()
