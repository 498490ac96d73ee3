"""What ``migrate`` installs: the triggers that make every source row a pending Execution;
and what a coordinator checks before it claims."""
