"""semcomm.server"""
