package groupcommit_test

import (
	"github.com/onceflow/onceflow/messagedata"
)

func msg(id string) *messagedata.MessageData {
	return &messagedata.MessageData{ID: id, Topic: "t", Attempt: 1}
}
