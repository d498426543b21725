package outbox

import (
	"strconv"

	"github.com/google/uuid"
)

// idNamespace is the UUID namespace of DerivedID.
var idNamespace = uuid.MustParse("6f3c2a1e-9b7d-4c55-8e0a-2d4f1b9c7e31")

// DerivedID returns a deterministic UUID (version 5) for the outgoing message called name that
// processing the incoming message incomingID produces. The same arguments always give the same
// id; different arguments give different ids.
//
// Use it for the UUID of messages passed to Publish: if the incoming message is processed
// again (a handler without duplicate detection, a retry after a rollback, a key whose
// retention has expired), the outgoing message gets the same id again, and the consumers'
// duplicate detection treats the second copy as the duplicate it is. A random id would make
// each copy look new.
func DerivedID(incomingID, name string) string {
	// The length prefix keeps ("ab", "c") and ("a", "bc") apart.
	data := strconv.Itoa(len(incomingID)) + ":" + incomingID + name
	return uuid.NewSHA1(idNamespace, []byte(data)).String()
}
