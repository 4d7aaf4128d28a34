"""semcomm.engine"""
