from pwcal.cli import main

main()
