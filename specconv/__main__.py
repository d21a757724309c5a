from specconv.cli import main

main()
