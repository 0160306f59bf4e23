"""shmloader"""
