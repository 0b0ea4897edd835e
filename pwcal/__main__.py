from pwcal.main import main

main()
