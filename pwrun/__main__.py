from pwrun.cli import main

main()
