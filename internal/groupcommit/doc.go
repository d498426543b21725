// Package groupcommit is the engine of group commit: the transaction stage of a handler whose
// concurrent deliveries share one database transaction and one commit (New), and the lane's
// way in, by which a consumer hands it a delivery without a goroutine waiting (Joiner,
// AfterJoin). The router builds it from Handler.GroupCommit; no user calls it.
package groupcommit
