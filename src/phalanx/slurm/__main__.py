from phalanx.slurm.main import main

main()
